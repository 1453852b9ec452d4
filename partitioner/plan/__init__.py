"""The plan: a frozen record of what was decided and what it is predicted to cost
(:mod:`.model`), its JSON schema (:mod:`.schema`, ``plan.schema.json``) and file IO."""
