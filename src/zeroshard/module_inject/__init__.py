"""`deepspeed.module_inject`: the AutoTP training mode switch scripts call (`layers.set_autotp_mode`)."""
