package main

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"slices"
	"strconv"
	"time"

	"github.com/golang-migrate/migrate/v4"
	"github.com/golang-migrate/migrate/v4/database"
	pgxmigrate "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// The schema ships inside the binary, so the binary and its migrations can
// never disagree about which version they expect.
//
//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration modes (KUMIKO_MIGRATIONS_MODE).
const (
	migrationsExitOnPending = "exit-on-pending"
	migrationsAutoApply     = "auto-apply"
	migrationsWarnOnPending = "warn-on-pending"
)

// migrationsTable is golang-migrate's version table (its default name, kept
// so databases migrated by earlier releases stay readable).
const migrationsTable = "schema_migrations"

// migrator wraps golang-migrate. golang-migrate holds a Postgres advisory
// lock while it works, so two instances that auto-apply at the same moment
// serialise: the second finds nothing left to do. Each migration commits
// together with its version row (atomicDriver), so a crash or a stop at any
// moment leaves the schema at a clean version.
type migrator struct {
	m        *migrate.Migrate
	driver   *atomicDriver
	conns    *sql.DB
	versions []uint // every version the binary ships, ascending
}

// newMigrator opens the migrator on connections of its own, made like the
// pool's but not taken from it: golang-migrate waits for its advisory lock
// with no context to cancel, and a boot aborted during that wait must not
// leave the pool's Close waiting for the connection. On these connections
// lock_timeout bounds that wait, and statement_timeout every migration, to
// wait (the phase timeout); so does idle_in_transaction_session_timeout, the
// pool's seconds being for a request's short transaction: a migration's
// transaction pauses between statements while this process is starved
// (a boot with both cores busy lost migration 1 to a 2 s bound), and the
// other instances wait on the advisory lock meanwhile anyway.
func newMigrator(pool *pgxpool.Pool, wait time.Duration) (*migrator, error) {
	src, err := iofs.New(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("reading the embedded migrations: %w", err)
	}
	versions, err := embeddedVersions()
	if err != nil {
		return nil, err
	}
	cc := pool.Config().ConnConfig // a copy
	ms := strconv.FormatInt(wait.Milliseconds(), 10)
	cc.RuntimeParams["lock_timeout"], cc.RuntimeParams["statement_timeout"] = ms, ms
	cc.RuntimeParams["idle_in_transaction_session_timeout"] = ms
	conns := stdlib.OpenDB(*cc)
	pgxDriver, err := pgxmigrate.WithInstance(conns, &pgxmigrate.Config{MigrationsTable: migrationsTable})
	if err != nil {
		conns.Close()
		return nil, fmt.Errorf("preparing the migrations table: %w", err)
	}
	driver := &atomicDriver{Driver: pgxDriver, conns: conns, ctx: context.Background(), ran: database.NilVersion}
	m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
	if err != nil {
		driver.Close()
		conns.Close()
		return nil, fmt.Errorf("creating the migrator: %w", err)
	}
	return &migrator{m: m, driver: driver, conns: conns, versions: versions}, nil
}

// atomicDriver is golang-migrate's pgx driver with one change: a migration
// and its version row commit in one transaction. golang-migrate itself marks
// the version dirty (one commit), runs the migration (another) and clears
// the flag (a third), so a crash or a stop between two of them left a dirty
// schema that only a person could mend, even when the migration had
// committed (issue 32). PostgreSQL's DDL is transactional, so here the dirty
// mark is never written: Run applies the migration and records its version
// together, or rolls both back. No shipped migration uses what a transaction
// refuses (CREATE INDEX CONCURRENTLY, VACUUM; TestMigrationsAreAllOrNothing
// would fail on one).
type atomicDriver struct {
	database.Driver
	conns *sql.DB
	// ctx is the context of the current up or down (withContext): its end
	// rolls back the migration in progress.
	ctx context.Context
	// dirty is the version golang-migrate is about to run (it marks it dirty
	// first); ran is the version Run last recorded, whose "clean" mark
	// golang-migrate then sends again.
	dirty, ran int
}

func (d *atomicDriver) SetVersion(version int, dirty bool) error {
	if dirty {
		d.dirty = version // recorded by Run, with the migration
		return nil
	}
	if version == d.ran {
		d.ran = database.NilVersion
		return nil // Run recorded it
	}
	return d.Driver.SetVersion(version, false) // a migration without a body, or migrate force
}

func (d *atomicDriver) Run(migration io.Reader) error {
	body, err := io.ReadAll(migration)
	if err != nil {
		return fmt.Errorf("reading migration %d: %w", d.dirty, err)
	}
	tx, err := d.conns.BeginTx(d.ctx, nil)
	if err != nil {
		return fmt.Errorf("migration %d: %w", d.dirty, err)
	}
	defer tx.Rollback() // a no-op after Commit
	if _, err := tx.ExecContext(d.ctx, string(body)); err != nil {
		return fmt.Errorf("migration %d rolled back: %w", d.dirty, err)
	}
	// As the pgx driver's SetVersion: one row, or none below the first version.
	if _, err := tx.ExecContext(d.ctx, `TRUNCATE `+migrationsTable); err != nil {
		return fmt.Errorf("migration %d rolled back: recording its version: %w", d.dirty, err)
	}
	if d.dirty >= 0 {
		if _, err := tx.ExecContext(d.ctx, `INSERT INTO `+migrationsTable+` (version, dirty) VALUES ($1, false)`, d.dirty); err != nil {
			return fmt.Errorf("migration %d rolled back: recording its version: %w", d.dirty, err)
		}
	}
	if err := tx.Commit(); err != nil {
		// The commit may have reached the server all the same: the version
		// row says which, and it is never half-way.
		return fmt.Errorf("migration %d: commit not confirmed: %w", d.dirty, err)
	}
	d.ran = d.dirty
	return nil
}

// embeddedVersions lists the versions of the *.up.sql files in the binary.
func embeddedVersions() ([]uint, error) {
	names, err := fs.Glob(migrationFiles, "migrations/*.up.sql")
	if err != nil {
		return nil, fmt.Errorf("listing the embedded migrations: %w", err)
	}
	var versions []uint
	for _, name := range names {
		var v uint
		if _, err := fmt.Sscanf(name, "migrations/%d_", &v); err != nil {
			return nil, fmt.Errorf("migration %s has no numeric version prefix: %w", name, err)
		}
		versions = append(versions, v)
	}
	slices.Sort(versions)
	return versions, nil
}

// Close releases the migrator's connections (the pool stays open).
func (mg *migrator) Close() error {
	srcErr, dbErr := mg.m.Close()
	return errors.Join(srcErr, dbErr, mg.conns.Close())
}

// schemaStatus is where the database is relative to the binary.
type schemaStatus struct {
	Version uint // 0: never migrated
	Dirty   bool
	Latest  uint // newest version the binary ships
	Pending []uint
}

// status reads the version under the migration lock: while an instance of
// an earlier release (before atomicDriver) applies a migration the version
// row is marked dirty, and an unlocked read would mistake that for a
// migration that failed half-way.
func (mg *migrator) status() (schemaStatus, error) {
	if err := mg.driver.Lock(); err != nil {
		return schemaStatus{}, fmt.Errorf("taking the migration lock: %w", err)
	}
	defer mg.driver.Unlock()
	st := schemaStatus{}
	if len(mg.versions) > 0 {
		st.Latest = mg.versions[len(mg.versions)-1]
	}
	v, dirty, err := mg.m.Version()
	switch {
	case errors.Is(err, migrate.ErrNilVersion):
	case err != nil:
		return st, fmt.Errorf("reading the schema version: %w", err)
	default:
		st.Version, st.Dirty = v, dirty
	}
	for _, v := range mg.versions {
		if v > st.Version {
			st.Pending = append(st.Pending, v)
		}
	}
	return st, nil
}

// up applies every pending migration, stopping between two migrations when ctx ends.
func (mg *migrator) up(ctx context.Context) error {
	return mg.withContext(ctx, mg.m.Up)
}

// force records version as the schema's version and clears the dirty flag,
// without running anything: the repair after a migration failed half-way.
func (mg *migrator) force(version int) error {
	if err := mg.m.Force(version); err != nil {
		return fmt.Errorf("forcing version %d: %w", version, err)
	}
	return nil
}

// down rolls back n migrations.
func (mg *migrator) down(ctx context.Context, n int) error {
	return mg.withContext(ctx, func() error { return mg.m.Steps(-n) })
}

// withContext runs a golang-migrate call that knows no context. On ctx's end
// it asks for a graceful stop, which golang-migrate honours between
// migrations, and cancels the migration in progress, which rolls back with
// its version (atomicDriver) unless its commit was already on its way: the
// schema stays at the last version that committed, clean, and the next up
// goes on from there. The error then says where the schema stands, read
// back from the version row.
func (mg *migrator) withContext(ctx context.Context, fn func() error) error {
	mg.driver.ctx = ctx
	defer func() { mg.driver.ctx = context.Background() }()
	stop := context.AfterFunc(ctx, func() {
		select {
		case mg.m.GracefulStop <- true:
		default:
		}
	})
	defer stop()
	err := fn()
	if errors.Is(err, migrate.ErrNoChange) {
		err = nil
	}
	if ctx.Err() == nil {
		return err
	}
	at := "unknown"
	if v, dirty, verr := mg.m.Version(); verr == nil {
		at = fmt.Sprintf("%d (dirty %t)", v, dirty)
	} else if errors.Is(verr, migrate.ErrNilVersion) {
		at = "0 (nothing applied)"
	}
	if err != nil {
		return fmt.Errorf("migrations stopped (%w) during a migration (%v); the schema is at version %s, the last one that committed, and the next up goes on from there", context.Cause(ctx), err, at)
	}
	return fmt.Errorf("migrations stopped (%w) between two migrations; the schema is at version %s, and the next up goes on from there", context.Cause(ctx), at)
}

// ---------------------------------------------------------------------------
// Phases 8 and 9

// schemaBaseline is phase 8. It refuses a database that this binary can no longer migrate:
// a dirty one (a migration failed half-way and needs a human) or one older than
// the baseline the binary's migrations start from. A fresh database is left to
// phase 9.
func (a *app) schemaBaseline(ctx context.Context, p *phaseRun) error {
	baseline := a.cfg.Lifecycle.Migrations.SchemaBaseline
	if baseline == 0 {
		return skipPhase("KUMIKO_SCHEMA_BASELINE is not set")
	}
	mg, st, err := a.readSchema(ctx)
	if err != nil {
		return err
	}
	mg.Close()
	switch {
	case st.Version == 0:
		p.note = "fresh database: phase migrationsCheck creates the schema"
	case st.Version < baseline:
		return fmt.Errorf("schema version %d is older than baseline %d that this binary supports: migrate with an older release first", st.Version, baseline)
	}
	return nil
}

// readSchema opens a migrator and reads where the schema is, refusing a
// dirty one with the command that mends it: how phases 8 and 9 begin. On
// success the caller closes the migrator.
func (a *app) readSchema(ctx context.Context) (*migrator, schemaStatus, error) {
	mg, err := newMigrator(a.db, a.timeouts.phase)
	if err != nil {
		return nil, schemaStatus{}, err
	}
	st, err := mg.status()
	if err == nil && st.Dirty {
		err = mg.dirtySchema(ctx, st.Version)
	}
	if err != nil {
		mg.Close()
		return nil, schemaStatus{}, err
	}
	return mg, st, nil
}

// dirtySchema is the error for a schema marked dirty: a migration that an
// earlier release (before atomicDriver) or a hand-run tool left half-way.
// Each migration runs as one transaction, so its changes are either all
// there or not at all; a trial run of it, rolled back, tells which: if it
// applies, its changes are absent (or it is safe to run again) and the
// version before it is the truth; if it fails, they are present. The message
// names the one command that mends it.
func (mg *migrator) dirtySchema(ctx context.Context, version uint) error {
	before := -1 // golang-migrate's "nothing applied"
	for _, v := range mg.versions {
		if v < version {
			before = int(v)
		}
	}
	applies, trialErr := mg.tryMigration(ctx, version)
	switch {
	case trialErr != nil:
		return fmt.Errorf("schema version %d is dirty: migration %d was interrupted, and a trial run of it could not tell whether its changes are present (%v); inspect the schema, then run `kumiko-lifecycle-demo migrate force %d` if they are, or `migrate force %d` if not (scripts/migrate-force.sh)",
			version, version, trialErr, version, before)
	case applies:
		return fmt.Errorf("schema version %d is dirty: migration %d was interrupted and its changes are absent, or it is safe to run again (a trial run of it, rolled back, applies cleanly); mend it with `kumiko-lifecycle-demo migrate force %d` (scripts/migrate-force.sh %d), and the next boot applies %d again",
			version, version, before, before, version)
	default:
		return fmt.Errorf("schema version %d is dirty: migration %d was interrupted after its changes committed (a trial run of it fails on them); mend it with `kumiko-lifecycle-demo migrate force %d` (scripts/migrate-force.sh %d)",
			version, version, version, version)
	}
}

// tryMigration runs the up migration of version in a transaction it always
// rolls back, and says whether it applied.
func (mg *migrator) tryMigration(ctx context.Context, version uint) (bool, error) {
	names, err := fs.Glob(migrationFiles, fmt.Sprintf("migrations/%06d_*.up.sql", version))
	if err != nil || len(names) != 1 {
		return false, fmt.Errorf("this binary does not ship migration %d", version)
	}
	body, err := migrationFiles.ReadFile(names[0])
	if err != nil {
		return false, fmt.Errorf("reading %s: %w", names[0], err)
	}
	tx, err := mg.conns.BeginTx(ctx, nil)
	if err != nil {
		return false, fmt.Errorf("starting the trial: %w", err)
	}
	defer tx.Rollback()
	_, err = tx.ExecContext(ctx, string(body))
	return err == nil, nil
}

// migrationsCheck is phase 9: it applies or reports pending migrations per KUMIKO_MIGRATIONS_MODE.
func (a *app) migrationsCheck(ctx context.Context, p *phaseRun) error {
	mode := a.cfg.Lifecycle.Migrations.Mode
	mg, st, err := a.readSchema(ctx)
	if err != nil {
		return err
	}
	defer mg.Close()
	if st.Version > st.Latest {
		// A rolled-back binary during a rolling deploy: expected, and the schema
		// must stay compatible with it (expand/contract migrations).
		p.warn(fmt.Sprintf("schema version %d is newer than this binary's %d (older binary during a deploy?)", st.Version, st.Latest))
		return nil
	}
	if len(st.Pending) == 0 {
		p.note = fmt.Sprintf("schema at version %d, mode %s", st.Version, mode)
		return nil
	}
	switch mode {
	case migrationsAutoApply:
		if err := mg.up(ctx); err != nil {
			return fmt.Errorf("applying migrations %v: %w", st.Pending, err)
		}
		p.note = fmt.Sprintf("applied up to version %d (mode %s)", st.Latest, mode)
		return nil
	case migrationsWarnOnPending:
		p.warn(fmt.Sprintf("%d pending migrations %v (db at %d); running on the old schema", len(st.Pending), st.Pending, st.Version))
		return nil
	default:
		return fmt.Errorf("%d pending migrations %v (db at version %d, binary at %d): run `kumiko-lifecycle-demo migrate up` or set KUMIKO_MIGRATIONS_MODE=auto-apply",
			len(st.Pending), st.Pending, st.Version, st.Latest)
	}
}
