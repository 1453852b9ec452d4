"""The shared vocabulary every stage imports: the IR (:mod:`.ir`), the error family
(:mod:`.errors`), units and their formatting (:mod:`.units`) and file IO (:mod:`.files`).
Nothing here imports TensorFlow or any other package of ours."""
