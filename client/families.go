package client

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/api"
	"github.com/lazyfork/lazyfork/memfile"
)

// FamilyInfo describes a family's memory files on this host.
type FamilyInfo struct {
	Name string
	// Files are the family's memory files and the bytes each occupies on the tmpfs.
	Files map[string]int64
	// Bytes is the total of Files: memory shared by every fork of the family.
	Bytes int64
	// Holders are the containers and snapshots that pin files, with the files.
	Holders map[string][]string
	// MemoryCgroup is the memory cgroup of the family's shim, which the
	// files its checkpoint rewrites wrote are charged to ("" if no
	// checkpoint was rewritten yet).
	MemoryCgroup string
	// ChargedTo is the memory cgroup each file is charged to, where it was
	// recorded: a rewrite's to its shim, a moved container's to the
	// container.
	ChargedTo map[string]string
}

// Families reports every family in LazyFork's memory store, by name.
func (c *Client) Families() ([]FamilyInfo, error) {
	memRoot := api.Root(c.root).Mem()
	ents, err := os.ReadDir(memRoot)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	store, err := memfile.OpenStore(memRoot)
	if err != nil {
		return nil, err
	}
	var out []FamilyInfo
	for _, e := range ents {
		if !e.IsDir() || strings.HasPrefix(e.Name(), ".") {
			continue
		}
		fi := FamilyInfo{Name: e.Name(), Files: map[string]int64{}}
		files, _ := os.ReadDir(filepath.Join(memRoot, e.Name()))
		for _, f := range files {
			if !strings.HasSuffix(f.Name(), memfile.FileExt) || strings.HasPrefix(f.Name(), ".") {
				continue
			}
			var st unix.Stat_t
			if unix.Stat(filepath.Join(memRoot, e.Name(), f.Name()), &st) == nil {
				fi.Files[f.Name()] = st.Blocks * 512
				fi.Bytes += st.Blocks * 512
			}
		}
		if h, err := store.Holders(e.Name()); err == nil {
			fi.Holders = h
		}
		if ch, err := store.Charges(e.Name()); err == nil {
			fi.ChargedTo = map[string]string{}
			for f, cg := range ch {
				if _, ok := fi.Files[f]; ok {
					fi.ChargedTo[f] = cg
				}
			}
		}
		if b, err := os.ReadFile(api.Root(c.root).FamilyRecord(e.Name())); err == nil {
			var rec api.FamilyRecord
			if json.Unmarshal(b, &rec) == nil {
				fi.MemoryCgroup = rec.MemoryCgroup
			}
		}
		out = append(out, fi)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}
