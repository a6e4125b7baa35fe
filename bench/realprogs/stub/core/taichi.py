"""Stand-in for taichi_benchmark's core/taichi.py (which reaches into taichi._lib to name the
commit): the base class of its benchmarks only."""


class TaichiBenchmark:
    name = ""
    archs = []
    matrix = {}
    tags = {}
    repeats = 20

    def check_configuration(self, **_):
        return True

    def iter_exit(self):
        pass
