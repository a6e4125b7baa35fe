"""Shorten a GeoTaichi example for a comparison run: CPU, one thread, STEPS time steps, four
saves; postprocessing dropped.

    python geo_shorten.py EXAMPLE.py OUT.py STEPS
"""
import re
import sys

src, dst, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
s = open(src).read()
def init_repl(m):
    args = re.sub(r"device_memory_GB\s*=\s*[\d.e]+\s*,?\s*", "", m.group(1)).strip().rstrip(',')
    return f"init({args + ', ' if args else ''}arch='cpu', cpu_max_num_threads=1)"
s = re.sub(r"^init\((.*)\)\s*$", init_repl, s, count=1, flags=re.M)
dt = float(re.search(r'"Timestep"\s*:\s*([\d.e+-]+)', s).group(1))
T = dt * steps
s = re.sub(r'("SimulationTime"\s*:\s*)[\d.e+-]+', lambda m: m.group(1) + repr(T), s)
s = re.sub(r'("SaveInterval"\s*:\s*)[\d.e+-]+', lambda m: m.group(1) + repr(T / 4), s)
s = re.sub(r'SimulationTime\s*=\s*[\d.e+-]+', f'SimulationTime={T!r}', s)
s = re.sub(r'SaveInterval\s*=\s*[\d.e+-]+', f'SaveInterval={T / 4!r}', s)
s = re.sub(r'^(\S*\.postprocessing\(.*)$', r'# \1', s, flags=re.M)
s = re.sub(r'^(ti\.profiler\..*)$', r'# \1', s, flags=re.M)
open(dst, 'w').write(s)
