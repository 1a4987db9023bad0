"""What a running job tells: the per-step metrics (``metrics.jsonl`` and the console line), their
TensorBoard / W&B sinks, and throughput, memory and profiler windows (``performance.py``).

May import: ``trainer.config``.
"""
