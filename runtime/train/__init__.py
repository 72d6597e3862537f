"""The per-worker side of training: what every Ray Train worker (or a one-worker trial's thread)
runs, composed of small parts (torchtitan-style). The driver that starts it is ``runtime.launch``;
nothing here imports it (the layer test in tests/unit/test_import_graph.py fails on such an import).

- ``worker``: Ray Train's entry point (``train_loop_per_worker``) and one rank's whole life
  (``run_rank``: build, restore, fit, close).
- ``trainer``: the core: build the parts, then ``while not done: step; ask each component; at a
  boundary: evaluate, exchange, checkpoint, report``.
- ``step``: one optimizer step (``OptimizerStep``, which ``Trainer`` extends): accumulation over
  loader batches and micro-batches, the out-of-memory redo, the non-finite skip, the probe.
- Components that own a cadence: ``checkpointer`` (when to save), ``evaluator`` (when and how to
  evaluate), ``stop_policy`` (when to end: length, non-finite steps, preemption, cost),
  ``metrics_assembler`` (what a boundary reports).
- ``loop_state``: the loop's resumable state (``TrainState``, ``Stateful``, where a resized run resumes
  in the epoch); ``resume``: the checkpoint payload and restoring the newest one that verifies.
- ``setup``: builders (placement, precision, optimizer, schedule, seeding, DDP comm hooks,
  compile) and the device-side skip of a non-finite step; ``parallel``: DDP, or FSDP2 block by block.
- ``model_zoo``: the model zoo (torchvision ResNets/ViT, an MLP, the GPT-style decoder); ``export``:
  a run's final checkpoint as an MLflow model.
- ``device_input``: host batches with their epoch position, copied to the device one batch ahead;
  ``microbatch``: the micro-batch size (probe, split, out-of-memory redo).
- ``stats``: step statistics kept on the device and read once per boundary, where the ranks also
  agree on control flags (preempt, stop, new commit).
- ``hangwatch``: each rank's progress published to the process group's store from a thread; rank 0
  names a hung rank, its host and where it is before the collective timeout fails the step.
- ``reporter``: where a report goes (the driver's stream, Ray Train, Prometheus, cost gauges).
- ``drain``: giving a drained node back to Ray once the run has committed on it.
- ``spares``: spare worker processes for the next group; ``capacity``: refreshing Ray's view of
  the cluster (the spares' watch and the driver's elastic callback both ask it).
- ``timeline``: where a restart's seconds go (the controller's stamps and the workers').
- ``hold``: the step barrier tests inject faults at (``RT_TEST_HOLD``); ``sample_log``: the sample ids each
  step trained on, per rank, that tests read (``RT_TEST_SAMPLES``).

This package file imports nothing heavy.
"""
