"""The run directory, in one place: everything posttrain writes under output_dir, and reads back from it.

    claim           the marker, claim and takeover of output_dir, failed attempts set aside, the run's end recorded
    checkpoint      checkpoints/step-N: save (temporary name, then rename), resume, final/ export
    files           pure file helpers: manifests with checksums, fsync, atomic replace, disk-full messages
    resume          what a resume needs from the engine that wrote a checkpoint (DeepSpeed universal conversion)
    metrics         metrics.jsonl: the writer (progress bar, trackers) and the reader

The report drawn from these files is posttrain/report/.
"""
