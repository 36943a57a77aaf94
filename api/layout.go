package api

import "path/filepath"

// DefaultRoot is where LazyFork mounts its tmpfs (LAZYFORK_ROOT changes it).
const DefaultRoot = "/run/lazyfork"

// DefaultAPISocket is where lazyfork-snapshotter serves its ttrpc API
// (lazyfork.v1: Snapshotter and Node) on a node set up by lazyfork setup.
const DefaultAPISocket = DefaultRoot + "/snapshotter.sock.ttrpc"

// Root is LazyFork's root directory, a tmpfs: everything the parts share on
// one host lives under it and vanishes at reboot.
//
//	ROOT/mem/                  memory files, by family (memfile.Store)
//	ROOT/mem/.state/           references and owners of the families' files
//	ROOT/mem/.views/           each container's view of its lineage's files
//	ROOT/snapshots/<id>/image  snapshot images (CRIU dump + SnapshotFile + SourceFile)
//	ROOT/snapshots/<id>/RootfsFile  where the snapshot's forks get the parent's layer
//	ROOT/families/<family>.json    FamilyRecord
//	ROOT/ops/<op>.json         journal of fork calls in progress (OpRecord)
//	ROOT/locks/                per-parent and per-operation locks of fork calls
//	ROOT/logs/                 restore logs kept for failed forks
//	ROOT/snapshotter.sock.ttrpc  the node API (APISocket), when setup starts
//	                           lazyfork-snapshotter there
//
// Only processes on the node open these files: the shim, the memfile store
// and lazyfork-snapshotter's node API (package node); clients (the CLI, the
// Go SDK) go through that API.
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

// APISocket is where lazyfork setup has lazyfork-snapshotter serve its ttrpc
// API for this root.
func (r Root) APISocket() string { return filepath.Join(string(r), "snapshotter.sock.ttrpc") }
