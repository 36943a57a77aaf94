package memfile_test

import (
	"context"
	"os"
	"strconv"
	"testing"

	"github.com/containerd/errdefs"

	"github.com/lazyfork/lazyfork/memfile"
)

// A family claimed alone is empty to GC and loses its owner; one claimed
// with its claimer's reference keeps it until that reference goes, even
// before it has a file (an import loading its dump, a root container before
// its view). A pid reference lives while its process does.
func TestClaimHeld(t *testing.T) {
	root := t.TempDir()
	t.Cleanup(func() { memfile.RemoveAll(root) })
	s, err := memfile.OpenStore(root)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	owner := memfile.Owner{Namespace: "ns1", Root: "c"}

	if err := s.Claim("bare", owner); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Owner("bare"); !errdefs.IsNotFound(err) {
		t.Errorf("a bare claim after GC: owner %v, want none (the family is empty)", err)
	}

	claim := memfile.HolderPID + strconv.Itoa(os.Getpid())
	if err := s.ClaimHeld("held", owner, claim, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GC(ctx); err != nil {
		t.Fatal(err)
	}
	if o, err := s.Owner("held"); err != nil || o.Namespace != "ns1" {
		t.Fatalf("a held claim after GC: owner %+v, %v; want ns1's", o, err)
	}
	// Another namespace cannot take it, nor hold it through a claim.
	if err := s.ClaimHeld("held", memfile.Owner{Namespace: "ns2", Root: "x"}, memfile.HolderPID+"1", ""); !errdefs.IsAlreadyExists(err) {
		t.Errorf("ns2 claims ns1's family: %v, want already exists", err)
	}
	if h, _ := s.Holders("held"); len(h) != 1 {
		t.Errorf("holders %v, want the claimer's alone", h)
	}
	if err := s.Unref("held", claim); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Owner("held"); !errdefs.IsNotFound(err) {
		t.Errorf("the claimer's reference dropped: owner %v, want the family gone", err)
	}
}
