"""One router per resource: sessions, fields, kernels, batch, jobs, health/metrics."""
