"""Language tests: each checks kernel results against NumPy computed independently."""
