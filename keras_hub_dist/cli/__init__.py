"""The `keras-hub-dist` command line; the package's only terminal output.

`main` parses the command and its subcommands (`validate`, `convert`,
`plan`) and runs them: `validate` through `keras_hub_dist.validate`'s
runner and report, `convert` through `keras_hub_dist.convert`, `plan`
(`plan`: its flags and its printout) through `keras_hub_dist.jobs`.
"""
