"""Policy pieces shared by both engines: miss rule, eviction order, background admission, cache
initialisation. Plain Python functions; the Numba kernel compiles the same functions."""
