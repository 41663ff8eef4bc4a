"""The runtime: devices and processes. Device meshes (`cluster`), TF clusters (`cluster_spec`,
`local_cluster`, `worker`, `exposure`), tf.distribute (`distribute`), where updates run
(`placement`) and memory readings (`memory`). The framework, layers and engine above it know
nothing of processes; `from tf_gpipe import cluster` (and the other names) still works."""
