package memfile

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
)

// Owner is who a family belongs to: the containerd namespace of the
// container that started it. Containers of other namespaces may neither
// join the family nor fork its members.
type Owner struct {
	Namespace string    `json:"namespace"` // containerd namespace
	Root      string    `json:"root"`      // id of the container that started the family
	Created   time.Time `json:"created"`
}

const ownerFile = "owner.json"

func (s *Store) ownerPath(family string) string { return filepath.Join(s.stateDir(family), ownerFile) }

// Claim records o as the owner of family unless it has one. It returns nil
// if the family is unowned (o is recorded) or owned by o.Namespace, and an
// error wrapping errdefs.ErrAlreadyExists, naming both namespaces, if
// another namespace owns it. The record lives in
// <root>/.state/<family>/owner.json until the family has no files, no
// holders and no views left (see GC): a family claimed with Claim alone is
// removed by the next GC until it has one. ClaimHeld claims and holds it in
// one step.
func (s *Store) Claim(family string, o Owner) error {
	return s.ClaimHeld(family, o, "", "")
}

// ClaimHeld is Claim that also records holder's reference, with no files
// (tied to bundle if set, as RefBundle), under the same lock: the family
// lives from its claim on. Between a bare Claim and the claimer's first
// file, reference or view, a GC (lazyfork gc, or the snapshotter's periodic
// one) would find the family empty and take its owner away. A claimer whose
// later files are held by other holders drops holder with Unref once they
// are; "" records none.
func (s *Store) ClaimHeld(family string, o Owner, holder, bundle string) error {
	if err := checkFamily(family); err != nil {
		return err
	}
	if o.Namespace == "" {
		return fmt.Errorf("claim family %s: empty namespace: %w", family, errdefs.ErrInvalidArgument)
	}
	unlock, err := s.lockFamily(family)
	if err != nil {
		return err
	}
	defer unlock()
	cur, err := s.readOwner(family)
	switch {
	case err == nil:
		if cur.Namespace != o.Namespace {
			return fmt.Errorf("family %s belongs to containerd namespace %q (started by container %q); a container of namespace %q cannot join or fork it: use another family name: %w",
				family, cur.Namespace, cur.Root, o.Namespace, errdefs.ErrAlreadyExists)
		}
	case !errdefs.IsNotFound(err):
		return err
	default:
		if o.Created.IsZero() {
			o.Created = time.Now().UTC()
		}
		if err := writeJSONAtomic(s.ownerPath(family), &o, 0o600); err != nil {
			return fmt.Errorf("claim family %s: %w", family, err)
		}
	}
	if holder == "" {
		return nil
	}
	return s.refLocked(family, holder, bundle, nil)
}

// Owner returns the owner of family; errdefs.ErrNotFound if it has none.
func (s *Store) Owner(family string) (*Owner, error) {
	if err := checkFamily(family); err != nil {
		return nil, err
	}
	return s.readOwner(family)
}

func (s *Store) readOwner(family string) (*Owner, error) {
	b, err := os.ReadFile(s.ownerPath(family))
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("owner of family %s: %w", family, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, fmt.Errorf("owner of family %s: %w", family, err)
	}
	var o Owner
	if err := json.Unmarshal(b, &o); err != nil || o.Namespace == "" {
		return nil, fmt.Errorf("owner record %s is unreadable (%v): remove it to let the next container claim the family: %w", s.ownerPath(family), err, errdefs.ErrDataLoss)
	}
	return &o, nil
}
