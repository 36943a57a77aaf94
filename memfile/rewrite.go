package memfile

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/errdefs"
	"github.com/containerd/log"
)

// SlotSize is the distance between two regions of a memory file. Each
// rewritten VMA owns one slot: its pages at the start, then holes up to the
// next slot, so an mremap growth of up to SlotSize reads zeros (a hole costs
// nothing until touched), and no two VMAs ever map adjacent file offsets, so
// the kernel can never merge a neighbour into a region (an earlier layout
// with adjacent slots let a merged VMA's growth expose its neighbour's bytes).
const SlotSize int64 = 1 << 40

// DefaultRebaseRatio: a delta larger than this share of the pages it sits on
// is rebased into fresh files.
const DefaultRebaseRatio = 0.25

// RewriteOptions tune Rewrite.
type RewriteOptions struct {
	Family string
	// MapDir is the directory recorded in the image for the files, as the
	// restored task sees it: MountPath for containers, the host family dir
	// for plain processes.
	MapDir string
	// Holder is the reference the new snapshot holds on its files
	// ("" = "snapshot:"+imageDir, which dies with imageDir/lazyfork.json).
	Holder string
	// RebaseRatio: 0 = DefaultRebaseRatio; negative = never rebase.
	RebaseRatio float64
	// Stage, if set, is called with the complete new image (lazyfork.json
	// included) in its staging directory, with the new memory file at its
	// final path and the family locked, before it is swapped in: a last
	// edit that must be atomic with the rewrite (e.g. madvguard.Apply). An
	// error aborts the rewrite and leaves imageDir unchanged.
	Stage func(ctx context.Context, stagingDir string) error
	// FileRoot is the host directory the dump's file paths are relative to
	// (the container's rootfs; "/" for plain processes on the host). When
	// set, dirty private file mappings (a program's .data) are converted
	// too: their clean pages are read from the file under FileRoot, only if
	// it is provably the file the dump mapped (see the package doc). ""
	// leaves every file mapping as it is.
	FileRoot string
	// WipeOnFork lists the ranges the dumped processes had marked
	// MADV_WIPEONFORK (ReadWipeOnFork). A private anonymous VMA inside one
	// loses its pages and gets the advice back: each copy starts it zeroed,
	// as a fork() child would. CRIU alone copies its bytes into every copy.
	WipeOnFork WipeOnFork
	// Patch, if set, splits the delta of every family mapping into patches
	// of family files instead of leaving its pages in the image (see
	// patch.go): for a parent that runs on its files without moving again.
	// Such a rewrite never rebases.
	Patch *PatchOptions
}

// Result describes a rewrite.
type Result struct {
	Files       []string // family files the snapshot maps (base names)
	PagesMoved  uint64   // pages moved from the image into a memory file (new, or a previous patch)
	PagesReused uint64   // of PagesMoved, pages a previous snapshot's patch holds
	// PagesPrivate, of PagesMoved, are the processes' own memory: their
	// anonymous VMAs' and patched pages, not their programs' .data.
	PagesPrivate uint64
	PagesKept    uint64 // pages left in the image
	BytesWritten int64  // bytes written into the new memory file
	PagesWiped   uint64 // pages dropped from wipe-on-fork VMAs (RewriteOptions.WipeOnFork)
	Rebased      bool
	Duration     time.Duration
	// NewFile is the memory file the rewrite wrote ("" if it wrote none).
	NewFile string
	// Premapped lists the tasks CRIU will premap at restore: their mappings
	// would need more than 256 open files at once otherwise (see premapDir).
	Premapped []uint32
	// Patches are the snapshot's patches (RewriteOptions.Patch), for the
	// next snapshot's PatchOptions.Previous.
	Patches []Patch
}

// Rewrite turns the CRIU dump in imageDir into a LazyFork snapshot: every
// private anonymous VMA that holds pages (and, with FileRoot, every dirty
// .data mapping whose file checks out) becomes a private mapping of a new,
// immutable file of the family, and its pages leave the image. See the
// package documentation for the layout and the rules.
//
// It is atomic: the new image is built beside imageDir and swapped in with
// one rename; on any error (or a crash) imageDir is unchanged.
//
// The rewrite runs in phases, each a function of what the previous ones
// produced: loadDump (read and classify), planVMAs (what converts, whether
// to rebase), writeMemory (layout and copy into the new memory file),
// stageImage (the new image beside imageDir) and commitRewrite (the store's
// part: name, seal, reference, swap).
func (s *Store) Rewrite(ctx context.Context, imageDir string, opts RewriteOptions) (*Result, error) {
	start := time.Now()
	if err := checkFamily(opts.Family); err != nil {
		return nil, err
	}
	if !filepath.IsAbs(opts.MapDir) || filepath.Clean(opts.MapDir) != opts.MapDir {
		return nil, fmt.Errorf("rewrite: MapDir %q must be a clean absolute path: %w", opts.MapDir, errdefs.ErrInvalidArgument)
	}
	imageDir, err := filepath.Abs(imageDir)
	if err != nil {
		return nil, err
	}
	imageDir = filepath.Clean(imageDir)
	ratio := opts.RebaseRatio
	if ratio == 0 {
		ratio = DefaultRebaseRatio
	}
	// What a rewrite that died left beside imageDir: its staging directory,
	// or, once swapped in, the old image.
	removeStaleStaging(imageDir)
	if _, err := os.Stat(filepath.Join(imageDir, SnapshotFile)); err == nil {
		return nil, fmt.Errorf("rewrite: %s is already a LazyFork snapshot: %w", imageDir, errdefs.ErrAlreadyExists)
	}
	famDir, err := s.FamilyDir(opts.Family)
	if err != nil {
		return nil, err
	}

	d, err := loadDump(imageDir, s.root, famDir, opts)
	if err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	defer d.close()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	pl, err := planVMAs(d, ratio)
	if err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	mf, err := writeMemory(ctx, s, d, pl)
	if err != nil {
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	if err := s.fault(faultWritten); err != nil {
		mf.abort()
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	st, err := stageImage(ctx, d, pl, mf)
	if err != nil {
		mf.abort()
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	if err := s.commitRewrite(ctx, d, mf, st); err != nil {
		mf.abort()
		st.abort()
		return nil, fmt.Errorf("rewrite %s: %w", imageDir, err)
	}
	res := &Result{
		Files: st.info.Files, PagesMoved: mf.moved, PagesKept: st.info.KeptPages, PagesWiped: pl.wiped,
		BytesWritten: mf.written, Rebased: pl.rebase, Duration: time.Since(start),
		Premapped: st.premapped, NewFile: mf.name(), PagesReused: mf.reused, PagesPrivate: mf.private, Patches: st.info.Patches,
	}
	log.G(ctx).WithField("image", imageDir).WithField("family", opts.Family).
		WithField("moved", res.PagesMoved).WithField("kept", res.PagesKept).
		WithField("rebased", res.Rebased).WithField("duration", res.Duration).Debug("memfile: rewritten")
	return res, nil
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}
