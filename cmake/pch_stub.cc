// Empty: the precompiled header of accel_torch_pch is built from this file.
