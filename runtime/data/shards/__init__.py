"""WebDataset-layout tar shards (``train/000000.tar`` with ``<key>.jpg`` + ``<key>.cls``),
read from a folder or streamed from an object store (``s3://``, ``gs://``, ``az://``), never staged.

Layout written by ``python -m runtime data pack``::

    <path>/index.json          classes, and every shard's sample count (written last)
    <path>/train/000000.tar    <key>.jpg + <key>.cls (the label, ASCII), members in key order
    <path>/val/000000.tar

One module per job, each importing only those listed before it:

- ``store``: the bytes of a data set, in a folder or on an object store (list, read the index, open a shard);
- ``plan``: an epoch's order, the same at every world size, and which samples each rank's loader
  workers read: each of the rank's pieces (a shard's samples in one reader) by one worker (pure arithmetic);
- ``tars``: reading a tar's samples, and the shard index;
- ``parts``: a batch's parts, one per loader worker, merged in the batch's order in the main process;
- ``stream``: the per-rank dataset and loader that resume mid-epoch;
- ``tools``: ``data pack``, verify and ``data inspect``.

This package imports nothing itself: callers name the module they use.
"""
