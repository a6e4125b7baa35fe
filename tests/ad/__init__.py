"""Reverse-mode autodiff tests: every gradient is checked against analytic derivatives or
float64 finite differences computed with NumPy, never against the backend itself."""
