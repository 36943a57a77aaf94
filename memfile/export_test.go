package memfile

import "testing"

// SetFault sets s's fault hook, called at each of FaultPoints of a rewrite.
func SetFault(s *Store, f func(point string) error) { s.faultAt = f }

// FaultPoints are the points of a rewrite a fault can be injected at, in the
// order a rewrite reaches them; the last comes after the swap.
var FaultPoints = faultPoints

// ExtractDump unpacks a committed dump of testdata/dumps into a fresh
// directory.
func ExtractDump(t testing.TB, name string) string { return extractDump(t, name) }
