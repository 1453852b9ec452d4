"""Stage 3b of the flow, *plan a strategy*: single device, data parallel, pipeline, plain split or
hybrid, chosen by the simulated step of what would run (:mod:`.search`), with a refinement search
scored by the simulator itself (:mod:`.refine`). Pure Python: nothing here imports TensorFlow."""
