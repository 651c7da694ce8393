"""GPU runtime: CuPy-compiled CUDA kernels for the packed layouts, and CUDA-graph decode.

Importing this package never imports cupy; `qtool.cuda.compile.require_cupy()` does, on first use of a kernel.
"""
