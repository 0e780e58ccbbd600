"""Optional C++ kernels, built on first use with torch.utils.cpp_extension and cached (see build.py)."""
