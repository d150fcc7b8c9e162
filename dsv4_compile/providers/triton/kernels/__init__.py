"""The Triton kernels themselves (plain ``@triton.jit``), one module per provider module of
:mod:`dsv4_compile.providers.triton`, which imports each (and with it Triton) on first use: importing
``dsv4_compile`` imports no Triton."""
