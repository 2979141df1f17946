"""C++ kernels with their Python wrappers, and the quantized linear layers built on them (int4, int8, w8a8, fp8).

Kernels never import the engine: the engine, the layers' fast paths and `tformer bench` call into them."""
