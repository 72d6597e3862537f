"""The driver side of training: what runs in the process that asks Ray Train for a run, and in
Ray Train's controller on the driver's node. The per-worker loop it starts is ``runtime.train``
(imported here, never the other way round).

- ``driver``: ``train(cfg)``: the run's lock, its attempts (more than one only when the spot price
  paused it), each report shown, kept and logged, the outcome and its summary.
- ``setup``: a run's set-up: ``connect`` (and what the workers inherit), GPUs or not, the run's
  identity and folders, the ``TorchTrainer`` and its controller callbacks (``FailureNotices``).
- ``stream``: one attempt executed while rank 0's reports stream back: ``StreamingFit`` (a Ray
  Train run) and ``InProcessFit`` (one rank on a thread), shared with Tune's trials.
- ``attempts``: the attempt loop's states and transitions (waiting for the price, running,
  finished, stopped while paused).
- ``torch_trainer``: Ray Train's ``TorchTrainer`` less the Ray Data actor a run never uses.
- ``elastic``: the controller callback that reports resizes and enforces the min-workers wait.
- ``runlock``: the run folder's lock: one driver per run; ``signals``: SIGTERM and Ctrl+C.

What crosses to the workers and back is typed in ``runtime.run`` (the bottom layer); the
driver's side of the cost rules is ``runtime.observe.cost.spend``.

This package file imports nothing heavy: Tune and tracking import ``runtime.run`` without the driver.
"""
