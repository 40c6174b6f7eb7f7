"""Test-wide setup: eight virtual CPU devices, so sharding tests can build meshes.

The flag must be set before JAX initialises its backends, hence here.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
