package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"syscall"
	"time"
	_ "time/tzdata" // embed the zone database: scratch/distroless images have none
)

// minOpenFiles is the fd limit below which a server runs out of sockets under
// load long before it runs out of CPU.
const minOpenFiles = 1024

// cgroupRoot is where cgroup v2 exposes this container's limits.
const cgroupRoot = "/sys/fs/cgroup"

// runtimeChecks is phase 4: facts about the runtime that would otherwise surface
// as a mystery under load. A misconfiguration that will hurt fails the boot; a
// suboptimal one is a warning.
func (a *app) runtimeChecks(ctx context.Context, p *phaseRun) error {
	facts, warnings, err := inspectRuntime(cgroupRoot)
	if fds, ok := facts["fd_limit"].(uint64); ok {
		if w := fdsForConnCap(fds, a.cfg.HTTP.MaxConns); w != "" {
			warnings = append(warnings, w)
		}
	}
	a.log.WithField("component", "lifecycle").WithField("phase", p.name).WithFields(facts).Info("runtime")
	if err != nil {
		return err
	}
	if len(warnings) > 0 {
		p.warn(strings.Join(warnings, "; "))
	}
	return nil
}

// fdsForConnCap warns when the open-file limit is reached before the API's
// connection cap: accepts would then fail (EMFILE) while the cap still has
// room, and the database and Redis connections would fail with them. It leaves
// minOpenFiles for everything that is not an API connection.
func fdsForConnCap(fdLimit uint64, maxConns uint) string {
	if maxConns == 0 || fdLimit >= uint64(maxConns)+minOpenFiles {
		return ""
	}
	return fmt.Sprintf("open-file limit %d is below KUMIKO_API_MAX_CONNS (%d) plus %d for the rest: "+
		"raise `ulimit -n` or lower the cap, or accepts fail before the cap is reached", fdLimit, maxConns, minOpenFiles)
}

// inspectRuntime reads the Go version, GOMAXPROCS and GOMEMLIMIT against the
// cgroup's CPU and memory limits, the embedded zone database and the fd limit.
func inspectRuntime(cgroupDir string) (facts map[string]any, warnings []string, err error) {
	var problems []error
	facts = map[string]any{"go_version": runtime.Version(), "gomaxprocs": runtime.GOMAXPROCS(0), "num_cpu": runtime.NumCPU()}

	// Go ≥1.25 sizes GOMAXPROCS from the cgroup CPU limit by itself, unless the
	// GOMAXPROCS variable pins it: then a pinned value above the quota means
	// throttling.
	if quota, ok := cgroupCPUQuota(cgroupDir); ok {
		facts["cgroup_cpu_limit"] = quota
		if float64(runtime.GOMAXPROCS(0)) > math.Ceil(quota) {
			warnings = append(warnings, fmt.Sprintf("GOMAXPROCS=%d exceeds the cgroup CPU limit %.2f: expect CPU throttling", runtime.GOMAXPROCS(0), quota))
		}
	}

	// GOMEMLIMIT above the container limit means the OOM killer acts before
	// the GC does; no GOMEMLIMIT at all under a limit is merely a missed chance.
	memLimit := debug.SetMemoryLimit(-1)
	if memLimit != math.MaxInt64 {
		facts["gomemlimit_bytes"] = memLimit
	}
	if cgMem, ok := cgroupMemoryLimit(cgroupDir); ok {
		facts["cgroup_memory_limit_bytes"] = cgMem
		switch {
		case memLimit == math.MaxInt64:
			warnings = append(warnings, fmt.Sprintf("GOMEMLIMIT is unset under a %d MiB memory limit: set it to about 90%% of it", cgMem>>20))
		case memLimit > cgMem:
			problems = append(problems, fmt.Errorf("GOMEMLIMIT %d MiB is above the cgroup memory limit %d MiB: the OOM killer would act before the GC", memLimit>>20, cgMem>>20))
		}
	}

	if _, err := time.LoadLocation("Europe/Berlin"); err != nil {
		problems = append(problems, fmt.Errorf("time zone database unavailable: %w", err))
	}

	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil {
		facts["fd_limit"] = rl.Cur
		if rl.Cur < minOpenFiles {
			problems = append(problems, fmt.Errorf("open-file limit %d is below %d: raise `ulimit -n`", rl.Cur, minOpenFiles))
		}
	}
	return facts, warnings, errors.Join(problems...)
}

// cgroupCPUQuota reads cpu.max ("max 100000" or "150000 100000") as CPUs.
func cgroupCPUQuota(dir string) (float64, bool) {
	raw, err := os.ReadFile(dir + "/cpu.max")
	if err != nil {
		return 0, false
	}
	fields := strings.Fields(string(raw))
	if len(fields) != 2 || fields[0] == "max" {
		return 0, false
	}
	quota, err1 := strconv.ParseFloat(fields[0], 64)
	period, err2 := strconv.ParseFloat(fields[1], 64)
	if err1 != nil || err2 != nil || period == 0 {
		return 0, false
	}
	return quota / period, true
}

// cgroupMemoryLimit reads memory.max ("max" or bytes).
func cgroupMemoryLimit(dir string) (int64, bool) {
	raw, err := os.ReadFile(dir + "/memory.max")
	if err != nil {
		return 0, false
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(raw)), 10, 64)
	if err != nil {
		return 0, false
	}
	return v, true
}
