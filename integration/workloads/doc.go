// Package workloads holds the programs that LazyFork's container tests and
// benchmarks run, and Go helpers that speak their protocols.
//
// counter.py (documented at its top) fills a heap with a per-page pattern, prints
// `tick N` about every 100 ms, verifies the heap on SIGUSR1 and writes a marker on
// SIGUSR2. scripts/images.sh copies every *.py here into the python test image at
// ImageDir. The helpers below read a counter's output from its log file (see
// harness.NewTask) and drive it through signals.
package workloads
