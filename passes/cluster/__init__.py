"""Running a plan across the tasks of a TensorFlow cluster (:mod:`.runtime`)."""
