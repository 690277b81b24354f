"""Lightning glue that both adapters share (the Trainer strategy in ``strategies/``, the Fabric strategy in
``fabric/``): constructor settings, launch checks, the precision policy, restarts. Each function takes explicit
values; nothing here imports the Trainer (``lightning.pytorch``)."""
