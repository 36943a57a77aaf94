// Package fidelity holds LazyFork's fidelity tests: real programs (glibc malloc,
// CPython with threads and a child, Go with FreeOSMemory) are dumped with the real
// CRIU, rewritten into memory files, and restored as many copies; every copy must
// continue where its parent was and pass a full check of its memory, and a write in
// one copy must stay invisible to every other. The package has no code of its own;
// the tests need root and CRIU (LAZYFORK_INTEGRATION=1 or CI=true).
package fidelity
