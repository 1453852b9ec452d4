"""Devices and how they connect: the device catalog (:mod:`.catalog`), link kinds
(:mod:`.communication`) and topologies (:mod:`.topology`). Pure Python."""
