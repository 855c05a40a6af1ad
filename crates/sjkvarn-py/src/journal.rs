//! The journal spec (`sjkvarn.backends()`, the presets): what the core states once, handed to
//! Python as plain dicts so that no journal setting is restated there.

use crate::errors;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use sjkvarn::journal::capability::{self, Backend};
use sjkvarn::journal::{JournalPreset, DEFAULT_JOURNAL, REFERENCE_JOURNAL};

/// A preset as `Config` fields: `min_tail`, `max_tail`, `staging` (`"K/V"` when keys and values
/// differ), `centre_keys`, `exact_recent`.
fn preset_dict(py: Python<'_>, p: JournalPreset) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("min_tail", p.min_tail)?;
    d.set_item("max_tail", p.max_tail)?;
    let staging = if p.k_staging == p.v_staging {
        p.k_staging.name().to_string()
    } else {
        format!("{}/{}", p.k_staging.name(), p.v_staging.name())
    };
    d.set_item("staging", staging)?;
    d.set_item("centre_keys", p.centre_keys)?;
    d.set_item("exact_recent", p.exact_recent)?;
    Ok(d)
}

/// The journal presets, stated once in the core: `{"default": {...}, "reference": {...}}`.
#[pyfunction]
fn journal_presets(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("default", preset_dict(py, DEFAULT_JOURNAL)?)?;
    out.set_item("reference", preset_dict(py, REFERENCE_JOURNAL)?)?;
    Ok(out)
}

/// The journal a backend (`"cpu"`, `"cuda"`, `"paged"`) runs by default, as `Config` fields.
#[pyfunction]
fn journal_for<'py>(py: Python<'py>, backend: &str) -> PyResult<Bound<'py, PyDict>> {
    let backend = Backend::from_name(backend).map_err(errors::cache)?;
    preset_dict(py, capability::journal_for(backend))
}

/// The capability table: backend -> setting -> the values it runs (`sjkvarn.backends()`).
#[pyfunction]
fn backends(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let out = PyDict::new(py);
    for (backend, row) in capability::backends() {
        let settings = PyDict::new(py);
        for (setting, values) in row {
            settings.set_item(setting.name(), values.to_vec())?;
        }
        out.set_item(backend.name(), settings)?;
    }
    Ok(out)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(journal_presets, m)?)?;
    m.add_function(wrap_pyfunction!(journal_for, m)?)?;
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    Ok(())
}
