"""The CPU decode step of the dense models in C++ (step.cpp) and its builder and loader (step.py),
tested against the torch step (tests/kernels/test_cpu_step.py)."""
