"""Framework-free parallelism: plain functions over modules, meshes and optimizers, callable without a Trainer."""
