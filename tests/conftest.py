"""Eight simulated CPU devices for every test in this process."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
