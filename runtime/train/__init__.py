"""Training: the driver that submits a run to Ray Train, and the per-worker trainer, composed of
small parts (torchtitan-style).

- ``driver``: the driver side: connect, build the TorchTrainer, stream reports, print the
  summary (``train()``); ``elastic``: the controller callback that reports resizes.
- ``models``: the model zoo (torchvision ResNets/ViT, an MLP, the GPT-style decoder).
- ``trainer``: the core: build the parts, then ``while not done: step; maybe_checkpoint;
  maybe_report`` (and the Ray Train entry point ``train_loop_per_worker``, in ``worker``).
- ``setup``: builders (placement, precision, optimizer, schedule, seeding, DDP comm hooks,
  compile) and the device-side skip of a non-finite step.
- ``parallel``: FSDP2 applied block by block.
- ``device_input``: host batches with their epoch position, copied to the device one
  batch ahead on a side CUDA stream; synthetic data generated once on the device.
- ``stats``: step statistics kept on the device and read once per boundary, where the
  ranks also agree on control flags (preempt, stop, new commit).
- ``resume``: the checkpoint manager, the checkpoint payload and restoring it.
- ``reporter``: where a report goes (driver stream, Ray Train, Prometheus, cost).
- ``tokens``: token sequences for the language model, made on the device.
- ``run``: what the driver hands each worker and what a run hands back.
- ``runlock``: the run folder's lock (host, pid, start): one driver per run.
- ``signals``: the driver's SIGTERM and Ctrl+C handling (commit at the next step, or stop now).
- ``hold``: the step barrier tests inject faults at (``RT_TEST_HOLD``).

This package file imports nothing heavy: Tune and tracking import ``run`` without the driver.
"""
