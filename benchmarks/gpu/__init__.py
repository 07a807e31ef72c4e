"""The GPU report's parts (benchmarks/gpu_report.py runs them): the section registry, the sections, the workloads
they train, the report's files, and the wheels the GPU machine needs (wheels.py, closure.py)."""
