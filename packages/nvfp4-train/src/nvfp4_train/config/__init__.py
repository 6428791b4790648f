"""The run's configuration: the generic typed YAML loader (`loader`) and the run config tree
(`run_config.Config`: every section, keys that moved between versions, `load_config`).

Floor 4: imports the section configs from the subpackages that own them (`data`, `model`,
`precision`, `mesh`, `optim`, `observe`) and the floor-0 modules.
"""
