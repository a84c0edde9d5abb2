"""What a checkpoint holds and how it reaches the disk: atomic files and sharded folders with
recovery (`io`), rlver's own checkpoint state (`state`), exactly-once transcripts on resume
(`resume`), a graceful stop with `last.ckpt` (`stopping`), and exported weights (`export`).

May import `rlver.core`, `rlver.parallel` and `rlver.modeling`. Never runs a rollout or an update.
"""
