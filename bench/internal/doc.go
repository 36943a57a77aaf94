// Package internal holds what LazyFork's benchmark programs share: report
// (tables on stdout, CSV files written atomically), plot (PNG charts with
// gonum.org/v1/plot: error bars, log axes, legends) and ctrbench (a private
// containerd with the counter workload, checkpoint/restore/fork
// measurements, cgroup memory).
//
// bench/ is a Go module of its own (go.mod), so that the repository's module
// does not carry the plotting dependencies; it uses the repository's
// packages (integration/harness, client, memfile, snapshotter) from the tree
// it sits in through a replace directive. Run the benchmarks with `make
// bench-*`, or from bench/ with `go run ./NAME`.
package internal
