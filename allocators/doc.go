// Package allocators checks that programs using common allocators stay
// correct in restored copies.
//
// It builds testdata/churn.c (a multi-threaded malloc/calloc/realloc/free
// churn that checks every calloc'ed block is zero and every stored pattern
// intact) with gcc, once per allocator: glibc's malloc, jemalloc (Debian's
// libjemalloc2, with its defaults and with decay 0) and mimalloc
// (libmimalloc2.0). The tests dump the program with real CRIU, guard the
// image (memfile/madvguard), restore forks and a fork of a fork and watch
// their failure counters; bench/allocators measures the same at length.
//
// The package is for tests and benchmarks only.
package allocators
