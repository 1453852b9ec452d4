"""Stage 4 of the flow, *simulate*: the predicted step of what the rewrite would run.

:mod:`.step` simulates one plain training step op by op; :mod:`.pipeline` simulates pipeline
stages under a micro-batch schedule; :mod:`.evaluate` scores a placement with them and
:mod:`.bounds` gives lower bounds. Pure Python: nothing here imports TensorFlow."""
