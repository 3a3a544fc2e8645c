"""CPU kernels the engine compiles for the machine it runs on (see `build.py`)."""
