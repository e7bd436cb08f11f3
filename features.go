package main

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/labstack/echo/v4"
)

// feature is everything one feature brings, declared up front so phase 6 can
// check the whole graph before anything connects: its routes, the events it
// publishes and subscribes to, its jobs and cron schedules, and the settings it
// cannot work without.
type feature struct {
	name          string
	routes        []route
	publishes     []string
	subscriptions []subscription
	jobs          []string
	crons         []cronSchedule
	requires      []setting
}

// route is one API route. Its handler is built in phase 15, once the
// dependencies it takes exist. A streaming route (SSE) is not an in-flight
// request for the drain: it is ended by drain step 4, not waited for.
type route struct {
	method, path string
	handler      func() echo.HandlerFunc
	streaming    bool
}

// subscription runs job whenever event is delivered from the outbox.
type subscription struct{ event, job string }

type cronSchedule struct{ job, spec string }

// setting is a configuration value a feature needs; present says whether it is set.
type setting struct {
	name    string
	present bool
}

// registerFeatures is phase 5: every feature of the process, in one list.
func (a *app) registerFeatures() []feature {
	return append([]feature{
		{
			name:      "lifecycle",
			publishes: []string{eventStateChanged, eventInstanceStateChanged},
		},
		{
			name:  "outboxRetention",
			jobs:  []string{jobPurgeOutbox},
			crons: []cronSchedule{{job: jobPurgeOutbox, spec: a.cfg.Outbox.PurgeCron}},
		},
		{
			name:          "orders",
			publishes:     []string{eventOrderCreated},
			jobs:          []string{jobIndexOrder, jobWriteReceipt, jobReport, jobSleep},
			subscriptions: a.orderSubscriptions(),
			crons:         []cronSchedule{{job: jobReport, spec: a.cfg.Jobs.ReportCron}},
			routes: []route{
				{method: http.MethodPost, path: "/api/orders", handler: func() echo.HandlerFunc {
					return handleCreateOrder(a.db, a.redis, a.timeouts, a.metrics, a.log.WithField("component", "orders"))
				}},
				{method: http.MethodGet, path: "/api/orders/:id", handler: func() echo.HandlerFunc { return handleGetOrder(a.db, a.timeouts) }},
				{method: http.MethodGet, path: "/api/orders", handler: func() echo.HandlerFunc {
					return handleListOrders(a.db, a.timeouts)
				}},
			},
		},
		{
			name: "events",
			routes: []route{
				{method: http.MethodGet, path: "/api/events", streaming: true, handler: func() echo.HandlerFunc {
					return handleEvents(a.sse, a.db, a.cfg.SSE, a.cfg.InstanceID, a.timeouts.request)
				}},
			},
		},
		{
			name: "dashboard",
			routes: []route{
				{method: http.MethodGet, path: "/api/instance", handler: func() echo.HandlerFunc {
					return handleInstance(a.lc, a.redis, a.cfg.InstanceID, a.timeouts.request)
				}},
			},
		},
	}, a.demoFeatures()...)
}

// demoFeatures are the demo-only routes, off with KUMIKO_DEMO_ENDPOINTS=false
// (then /api/slow is not registered and answers 404).
func (a *app) demoFeatures() []feature {
	if !a.cfg.HTTP.DemoEndpoints {
		return nil
	}
	return []feature{{
		name: "drainDemo",
		routes: []route{
			{method: http.MethodGet, path: "/api/slow", handler: func() echo.HandlerFunc { return handleSlow(a.cfg.HTTP.SlowMax) }},
		},
	}}
}

// orderSubscriptions are the jobs an order.created triggers: only those
// whose dependency is configured (a missing one is skipped at phase 11/12).
func (a *app) orderSubscriptions() []subscription {
	var subs []subscription
	if a.cfg.Search.URL != "" {
		subs = append(subs, subscription{event: eventOrderCreated, job: jobIndexOrder})
	}
	if a.cfg.Storage.Endpoint != "" {
		subs = append(subs, subscription{event: eventOrderCreated, job: jobWriteReceipt})
	}
	return subs
}

// validateFeatures is phase 6: every problem of the feature graph, all at once.
func validateFeatures(features []feature) error {
	var problems []error
	now := time.Now() // a cron spec must tick within a year of now
	seen := func(kind string) func(owner, name string) {
		owners := map[string]string{}
		return func(owner, name string) {
			if first, dup := owners[name]; dup {
				problems = append(problems, fmt.Errorf("%s %q is declared by both %s and %s", kind, name, first, owner))
				return
			}
			owners[name] = owner
		}
	}
	featureName, routeKey, eventName, jobName := seen("feature"), seen("route"), seen("event"), seen("job")

	events, jobs := map[string]bool{}, map[string]bool{}
	for _, f := range features {
		featureName("the feature list", f.name)
		for _, r := range f.routes {
			routeKey(f.name, r.method+" "+r.path)
			if !strings.HasPrefix(r.path, "/api/") {
				problems = append(problems, fmt.Errorf("feature %s: route %s %s is outside /api/", f.name, r.method, r.path))
			}
		}
		for _, e := range f.publishes {
			eventName(f.name, e)
			events[e] = true
		}
		for _, j := range f.jobs {
			jobName(f.name, j)
			jobs[j] = true
		}
		for _, s := range f.requires {
			if !s.present {
				problems = append(problems, fmt.Errorf("feature %s needs %s, which is not set", f.name, s.name))
			}
		}
	}
	// References are checked once every declaration is known, so the order of
	// the feature list does not matter.
	for _, f := range features {
		for _, s := range f.subscriptions {
			if !events[s.event] {
				problems = append(problems, fmt.Errorf("feature %s subscribes to unknown event %q", f.name, s.event))
			}
			if !jobs[s.job] {
				problems = append(problems, fmt.Errorf("feature %s subscribes unknown job %q to %q", f.name, s.job, s.event))
			}
		}
		for _, c := range f.crons {
			if !jobs[c.job] {
				problems = append(problems, fmt.Errorf("feature %s schedules unknown job %q", f.name, c.job))
			}
			if _, err := parseSchedule(c.spec, now); err != nil {
				problems = append(problems, fmt.Errorf("feature %s: cron %q for job %s: %w", f.name, c.spec, c.job, err))
			}
		}
	}
	return errors.Join(problems...)
}
