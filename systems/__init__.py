"""The systems under test: our paged engine with its KV policies, Hugging Face transformers, and vLLM.

Importing the package sets libgomp's spin count (unless the caller set one) before torch loads its OpenMP runtime:
with the default (spin for 300,000 iterations before sleeping) an OpenMP team on a shared, busy machine spins against
the other jobs and a 2-thread decode step can run slower than a 1-thread one; 1,000 keeps the idle-machine speed
within a few per cent and the loaded-machine speed close to one thread's. A process that imported torch before this
package keeps its own setting.

Servers are the exception: the engine's (systems/server.py says why) and vLLM's both run with libgomp's own default,
SERVER_SPIN_COUNT, over whatever this process carries, so an online comparison spins alike on both sides.
"""
import os

os.environ.setdefault("GOMP_SPINCOUNT", "1000")
SERVER_SPIN_COUNT = 300_000       # libgomp's default when OMP_WAIT_POLICY is unset
