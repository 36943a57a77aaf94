package node

import (
	"time"

	"github.com/lazyfork/lazyfork/api"
	pb "github.com/lazyfork/lazyfork/proto/lazyfork/v1"
)

func unixNano(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixNano()
}

func fromUnixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n).UTC()
}

func rootfsToPB(r *api.RootfsRecord) *pb.Rootfs {
	if r == nil {
		return nil
	}
	return &pb.Rootfs{Frozen: r.Frozen, UpperCopy: r.UpperCopy, Snapshotter: r.Snapshotter, Namespace: r.Namespace}
}

func rootfsFromPB(r *pb.Rootfs) *api.RootfsRecord {
	if r == nil {
		return nil
	}
	return &api.RootfsRecord{Frozen: r.Frozen, UpperCopy: r.UpperCopy, Snapshotter: r.Snapshotter, Namespace: r.Namespace}
}

func opToPB(r *api.OpRecord) *pb.OpRecord {
	return &pb.OpRecord{Id: r.ID, Namespace: r.Namespace, Parent: r.Parent, Pid: int64(r.PID), PidStart: r.PIDStart,
		Paused: r.Paused, SnapshotDir: r.SnapshotDir, ImageDir: r.ImageDir, Snapshotter: r.Snapshotter,
		Frozen: r.Frozen, Lease: r.Lease, Forks: r.Forks, CreatedUnixNano: unixNano(r.Created)}
}

func opFromPB(r *pb.OpRecord) *api.OpRecord {
	return &api.OpRecord{ID: r.Id, Namespace: r.Namespace, Parent: r.Parent, PID: int(r.Pid), PIDStart: r.PidStart,
		Paused: r.Paused, SnapshotDir: r.SnapshotDir, ImageDir: r.ImageDir, Snapshotter: r.Snapshotter,
		Frozen: r.Frozen, Lease: r.Lease, Forks: r.Forks, Created: fromUnixNano(r.CreatedUnixNano)}
}

func familyToPB(f *Family) *pb.Family {
	out := &pb.Family{Name: f.Name, Files: f.Files, Bytes: f.Bytes, MemoryCgroup: f.MemoryCgroup, ChargedTo: f.ChargedTo}
	if f.Holders != nil {
		out.Holders = map[string]*pb.HolderFiles{}
		for h, files := range f.Holders {
			out.Holders[h] = &pb.HolderFiles{Files: files}
		}
	}
	return out
}

func familyFromPB(f *pb.Family) Family {
	out := Family{Name: f.Name, Files: f.Files, Bytes: f.Bytes, MemoryCgroup: f.MemoryCgroup, ChargedTo: f.ChargedTo}
	if out.Files == nil {
		out.Files = map[string]int64{}
	}
	if f.Holders != nil {
		out.Holders = map[string][]string{}
		for h, files := range f.Holders {
			out.Holders[h] = files.GetFiles()
		}
	}
	return out
}
