"""Devices and how they connect: the device catalog (:mod:`.catalog`; device kinds and
families are its fields), link kinds (:mod:`.communication`), topologies (:mod:`.topology`),
TF_CONFIG (:mod:`.tf_config`), and the one way data files are read and checked against their
JSON Schemas (:mod:`.datafiles`). Pure Python."""
