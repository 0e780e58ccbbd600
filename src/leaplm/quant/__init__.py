"""Weight-only quantization: block formats (formats.py), the quantized linear (linear.py) and swapping a
model's weights at load (apply.py)."""
