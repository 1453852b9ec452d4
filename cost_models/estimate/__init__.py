"""Cost math without TensorFlow: the roofline per op (:mod:`.analytic`), its fitted calibration
(:mod:`.calibrate`), memory per layer (:mod:`.memory`) and the costed graph (:mod:`.costs`)."""
