"""Tools for a GPU host, built on the engine's public API: ``calibrate`` (measure a hardware
profile), ``replay`` (execute a policy's decisions with real copies and expert kernels),
``emulate`` (run a real model with a policy's substitutions inside it). They need torch (the
``[capture]`` extra) only where they touch the GPU; planning and comparing run anywhere."""
