// Package internal holds what LazyFork's benchmark programs share: report
// (tables on stdout, CSV files written atomically), plot (hand-drawn PNG charts,
// no plotting module) and ctrbench (a private containerd with the counter
// workload, checkpoint/restore/fork measurements, cgroup memory).
package internal
