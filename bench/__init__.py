"""bitfuse's benchmarks, run from the repository root as modules:

    python -m bench.models ltx2 ...     # a whole transformer in every mode (bench/models.py)
    python -m bench.ops                 # every op against eager and torch.compile
    python -m bench.norm_accuracy       # the norm kernels against float64
    python -m bench.report [--check]    # bench/README.md's results block from bench/results/
"""
