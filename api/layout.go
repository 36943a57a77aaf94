package api

import "path/filepath"

// DefaultRoot is where LazyFork mounts its tmpfs (LAZYFORK_ROOT changes it).
const DefaultRoot = "/run/lazyfork"

// Root is LazyFork's root directory, a tmpfs: everything the parts share on
// one host lives under it and vanishes at reboot.
//
//	ROOT/mem/                  memory files, by family (memfile.Store)
//	ROOT/mem/.state/           references and owners of the families' files
//	ROOT/mem/.views/           each container's view of its lineage's files
//	ROOT/snapshots/<id>/image  snapshot images (CRIU dump + SnapshotFile + SourceFile)
//	ROOT/snapshots/<id>/RootfsFile  where the snapshot's forks get the parent's layer
//	ROOT/families/<family>.json    FamilyRecord
//	ROOT/ops/<op>.json         journal of fork calls in progress (client)
//	ROOT/locks/                per-parent locks of fork calls (client)
//	ROOT/logs/                 restore logs kept for failed forks (client)
type Root string

// Mem is the root of the family memory store.
func (r Root) Mem() string { return filepath.Join(string(r), "mem") }

// Snapshots holds snapshot directories, one per snapshot.
func (r Root) Snapshots() string { return filepath.Join(string(r), "snapshots") }

// Families holds one FamilyRecord per family.
func (r Root) Families() string { return filepath.Join(string(r), "families") }

// FamilyRecord is where the record of a family lives.
func (r Root) FamilyRecord(family string) string {
	return filepath.Join(r.Families(), family+".json")
}

// Ops holds the journal of fork calls.
func (r Root) Ops() string { return filepath.Join(string(r), "ops") }

// Locks holds the locks that serialise fork calls per parent.
func (r Root) Locks() string { return filepath.Join(string(r), "locks") }

// Logs holds logs kept for the user (a failed restore's CRIU log).
func (r Root) Logs() string { return filepath.Join(string(r), "logs") }
